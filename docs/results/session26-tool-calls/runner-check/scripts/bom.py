print("bom")
