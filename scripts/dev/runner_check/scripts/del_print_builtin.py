class A:
    def __del__(self):
        import sys
        print('del', sys is not None, file=sys.stdout)
a = A()
x = 5
