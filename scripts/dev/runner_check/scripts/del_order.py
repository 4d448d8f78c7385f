import sys
class A:
    def __init__(s, n): s.n = n
    def __del__(s): print('del', s.n)
a = A(1); b = A(2); c = A(3)
