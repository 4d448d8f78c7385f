import warnings
warnings.warn('w')
