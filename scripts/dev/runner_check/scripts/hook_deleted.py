import sys
del sys.excepthook
1/0
