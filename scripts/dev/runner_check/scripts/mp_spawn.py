import multiprocessing as mp
def f(): print('in child')
if __name__ == '__main__':
    ctx = mp.get_context('spawn')
    p = ctx.Process(target=f); p.start(); p.join(); print('exit', p.exitcode)
