"""Beyond one machine: publish a recipe's models to S3-compatible storage
(:mod:`pipeline.remote.s3`) and write Kubernetes manifests that serve them
(:mod:`pipeline.remote.k8s`)."""
