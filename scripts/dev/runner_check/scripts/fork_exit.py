import os, sys, atexit
atexit.register(print, 'atexit', os.getpid() > 0)
pid = os.fork()
if pid == 0:
    print('child')
    sys.exit(5)
else:
    _, st = os.waitpid(pid, 0)
    print('parent', os.waitstatus_to_exitcode(st) if hasattr(os,'waitstatus_to_exitcode') else st>>8)
