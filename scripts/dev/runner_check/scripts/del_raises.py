class A:
    def __del__(self): 1/0
a = A()
print('end')
