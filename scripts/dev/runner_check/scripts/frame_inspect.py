import sys, traceback
traceback.print_stack()
f = sys._getframe()
print(f.f_back)
