import os
pid = os.fork()
if pid == 0:
    print('child')
else:
    os.waitpid(pid, 0)
    print('parent')
