import atexit
def f(): raise KeyboardInterrupt
atexit.register(f)
print('x')
