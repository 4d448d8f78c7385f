import sys
del sys.modules['__main__']
print('x')
