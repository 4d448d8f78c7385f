import sys
sys.unraisablehook = lambda u: print('unraisable', u.exc_type.__name__)
class A:
    def __del__(self): 1/0
a = A()
