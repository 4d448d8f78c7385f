import sys
x = (
