"""mla-deploy: ONNX export and deployment for Multi-head Latent Attention models.

Importing this package (or mla_deploy.runtime) never imports torch; the torch source model and
the exporter live in mla_deploy.modeling and mla_deploy.export (the `export` extra).
"""

__version__ = "0.1.0"
