import inspect
def f(): pass
try:
    print(inspect.getsource(f))
except Exception as e:
    print(type(e).__name__, e)
