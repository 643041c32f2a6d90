"""DSA ops. Each folder holds ``reference.py`` (pure PyTorch fp32 spec), ``triton.py`` (kernels) and an
``__init__.py`` exporting one dispatching function."""
