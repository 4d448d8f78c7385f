import weakref
class A: pass
a = A()
weakref.finalize(a, print, 'finalized')
print('end')
