import sys
print('x'*10)
