print("ÿ")
