import sys
def h(t,v,tb): sys.exit(9)
sys.excepthook = h
1/0
