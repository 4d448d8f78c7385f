import os
os._exit = lambda s: print('hijacked', s)
print('x')
