f = open('/tmp/rv/out.txt', 'w')
f.write('hello')
import sys
sys.stdout.write(open('/tmp/rv/out.txt').read())
