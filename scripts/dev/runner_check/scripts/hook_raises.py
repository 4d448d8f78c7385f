import sys
def h(t,v,tb): raise RuntimeError('hook broke')
sys.excepthook = h
1/0
