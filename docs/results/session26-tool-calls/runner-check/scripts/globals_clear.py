globals().clear()
print('x')
