import threading
def w(): raise KeyboardInterrupt
threading.Thread(target=w).start()
