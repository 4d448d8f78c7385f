import sys
sys.stdout = None
