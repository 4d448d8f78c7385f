import atexit, sys
def f(): sys.exit(7)
atexit.register(f)
print('x')
