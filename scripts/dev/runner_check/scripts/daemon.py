import threading, time
def w():
    while True:
        time.sleep(0.01)
threading.Thread(target=w, daemon=True).start()
print('main')
