import sys
sys.exit(3.0)
