import sys
class A:
    def __del__(self): sys.exit(4)
a = A()
