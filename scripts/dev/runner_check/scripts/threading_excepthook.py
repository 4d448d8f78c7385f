import threading, time
def w():
    time.sleep(0.1); raise ValueError('t')
threading.Thread(target=w).start()
