import sys
class W:
    def write(self, s): return len(s)
    def flush(self): raise OSError('no')
sys.stdout = W()
print('x')
