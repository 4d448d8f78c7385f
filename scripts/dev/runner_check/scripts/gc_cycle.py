class A:
    def __del__(self): print('del cycle')
a = A(); a.self = a
del a
print('end')
