import threading, sys
def w(): sys.exit(4)
t = threading.Thread(target=w); t.start(); t.join(); print('done')
