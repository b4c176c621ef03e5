"""qklab inside training frameworks other than transformers: ``torchtitan`` (``qklab[torchtitan]``).

Each integration is its own module, imported only when used, so its framework stays optional; each plugs
into the framework's public extension points and runs the same ``qklab.QK`` and ``qklab.attach`` as a
model of one's own. docs/integrations.md sets them beside transformers' and one's own PyTorch.
"""
