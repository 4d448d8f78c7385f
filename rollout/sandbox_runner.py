# The program every sandboxed interpreter runs as `python -I -B -u [-S] -c <this program> -`: it reads the
# script from stdin and runs it as `python -` does; it does not parse arguments or set limits (the sandbox
# does that). The build embeds the file from its first blank line on as python_script_runner()
# (rollout/sandbox_runner.cmake), so this header comment stays out of every interpreter's argv.
#
# It differs from `python -` in one way: once the script, its threads and its atexit functions are done,
# the script's data and objects leave its module in the order they were bound (their finalizers run while
# its modules, classes and functions are still there; open files flush), a collection of the young
# generations takes the script's fresh reference cycles, stdout and stderr are flushed, and the process
# ends with os._exit, skipping the interpreter's teardown of every module (11 ms of 12.5 for `pass` with
# the GPU host's site-packages, 5 of 6.5 on the development machine; a full collection instead would cost
# 15-20 ms after `import numpy, sympy`). The rest is python's, after CPython's pythonrun.c and
# Py_FinalizeEx:
# - the script is stdin's bytes compiled as "<stdin>" and run in a fresh __main__ module (the runner's own
#   names stay out of it, and the script cannot shadow the builtins the runner uses), with __file__ and
#   __cached__ set while it runs; sys.argv is ['-'];
# - an uncaught exception goes to sys.excepthook without the runner's frame (a syntax error without any),
#   sys.last_* set; a missing hook, a hook that raises or exits behave as python's;
# - SystemExit's code becomes the status as python makes it (None: 0; an int: its low byte, 255 outside
#   a C long; else printed to stderr and 1); KeyboardInterrupt ends the process by SIGINT (130 if blocked);
# - stdout and stderr are flushed unless None or closed; a failed flush exits with 120 (stdout's failure
#   reported as unraisable).
# Tested byte for byte against `python -` (tests/rollout/test_sandbox.cpp). Known differences: the
# runner's frames show in stack inspection and count against the recursion limit; finalizers run before
# the interpreter starts shutting down (an import in one works, a replaced sys.unraisablehook still sees
# their errors), and an old reference cycle is not collected; python's own refusals of a non-UTF-8 coding
# cookie and NUL bytes on stdin read differently.
#
# Everything from the first blank line on goes into every interpreter's argv byte for byte, so the
# explanations live in this header.

def _rlt_main():
    import sys, os, atexit, gc
    kept = (type(sys), type, type(_rlt_main))
    base = sys.modules['__main__']
    del base.__dict__['_rlt_main']
    m = type(sys)('__main__')
    g = m.__dict__
    g.update(base.__dict__)
    sys.modules['__main__'] = m
    sys.argv[:] = ['-']
    leave = os._exit
    src = sys.stdin.buffer.read()
    g['__file__'], g['__cached__'] = '<stdin>', None

    def to_stderr(text):
        err = sys.stderr
        try:
            if err is not None and not getattr(err, 'closed', False):
                err.write(text)
                return
        except Exception:
            pass
        try:
            os.write(2, text.encode('utf-8', 'backslashreplace'))
        except Exception:
            pass

    def status_of(code):
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 255 if -2**63 <= code < 2**63 else 255
        try:
            to_stderr(str(code) + '\n')
        except Exception:
            pass
        return 1

    def show(e):  # as python prints an exception it caught at the top, without the runner's own frame
        tb = e.__traceback__.tb_next
        sys.__excepthook__(type(e), e.with_traceback(tb), tb)

    def report(v, tb):
        t = type(v)
        v = v.with_traceback(tb)
        sys.last_type, sys.last_value, sys.last_traceback = t, v, tb
        if sys.version_info >= (3, 12):
            sys.last_exc = v
        hook = getattr(sys, 'excepthook', None)
        if hook is None:
            to_stderr('sys.excepthook is missing\n')
            sys.__excepthook__(t, v, tb)
            return 1
        broke = None
        try:
            hook(t, v, tb)
        except SystemExit as e:
            return status_of(e.code)
        except BaseException as e:
            broke = e
        if broke is not None:
            to_stderr('Error in sys.excepthook:\n')
            show(broke)
            to_stderr('\nOriginal exception was:\n')
            sys.__excepthook__(t, v, tb)
        return 1

    def run():
        failed = None
        try:
            code = compile(src, '<stdin>', 'exec', dont_inherit=True)
        except (SyntaxError, ValueError) as e:
            failed, tb = e, None
        else:
            try:
                exec(code, g)
            except SystemExit as e:
                return status_of(e.code), False
            except BaseException as e:
                failed, tb = e, e.__traceback__.tb_next
        if failed is None:
            return 0, False
        return report(failed, tb), isinstance(failed, KeyboardInterrupt)

    status, sigint = run()
    g.pop('__file__', None)
    g.pop('__cached__', None)
    shutdown = getattr(sys.modules.get('threading'), '_shutdown', None)
    exitfuncs = getattr(atexit, '_run_exitfuncs', None)
    if exitfuncs is None or ('threading' in sys.modules and shutdown is None):
        raise SystemExit(status)
    for step in (shutdown, exitfuncs):
        try:
            if step is not None:
                step()
        except BaseException:
            pass
    for name in ('last_type', 'last_value', 'last_traceback', 'last_exc'):
        if hasattr(sys, name):
            setattr(sys, name, None)
    if sys.modules.get('__main__') is m:
        sys.modules['__main__'] = base
    try:
        for name in [k for k, v in g.items() if not isinstance(v, kept) and k != '__builtins__']:
            g.pop(name, None)
        gc.collect(1)
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        broke = None
        try:
            if stream is None or getattr(stream, 'closed', False):
                continue
            stream.flush()
        except Exception as e:
            broke, status = e, 120
        if broke is not None and stream is sys.stdout:
            if sys.version_info >= (3, 13):
                to_stderr('Exception ignored on flushing sys.stdout:\n')
            else:
                to_stderr('Exception ignored in: %r\n' % (stream,))
            show(broke)
    if sigint:
        import signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 130
    leave(status)
_rlt_main()
