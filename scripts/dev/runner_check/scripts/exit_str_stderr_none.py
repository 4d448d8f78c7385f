import sys
sys.stderr = None
sys.exit('msg')
