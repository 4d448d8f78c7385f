import threading, time, sys
def w():
    time.sleep(0.2); print('thread')
threading.Thread(target=w).start()
sys.exit(3)
