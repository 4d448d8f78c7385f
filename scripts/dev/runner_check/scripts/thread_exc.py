import threading
def w(): 1/0
t = threading.Thread(target=w); t.start(); t.join(); print('done')
