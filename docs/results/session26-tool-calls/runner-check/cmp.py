import subprocess, sys, os, re, glob
runner = open(__import__("os").environ.get("RUNNER","/tmp/runner.py")).read()
pys = sys.argv[1].split(',')
scripts = sys.argv[2:]
env = {"PATH":"/usr/local/bin:/usr/bin:/bin","LANG":"C.UTF-8","OMP_NUM_THREADS":"1"}
def norm(s): return re.sub(rb' at 0x[0-9a-f]+', b' at 0x', s)
def run(args, src):
    p = subprocess.run(args, input=src, capture_output=True, env=env, timeout=30)
    return (norm(p.stdout), norm(p.stderr), p.returncode)
for f in scripts:
    src = open(f,'rb').read()
    for py in pys:
        a = run([py,'-I','-B','-u','-'], src)
        b = run([py,'-I','-B','-u','-c',runner,'-'], src)
        tag = 'SAME' if a==b else 'DIFF'
        print(f"== {os.path.basename(f)} {os.path.basename(py)}: {tag}")
        if a!=b:
            print("  python -:", a)
            print("  runner  :", b)
