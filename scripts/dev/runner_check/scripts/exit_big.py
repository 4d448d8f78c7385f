import sys
sys.exit(2**40)
