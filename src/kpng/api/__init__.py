"""The wire API: the localv1, globalv1, batchv1 and pluginv1 protos and their codecs."""

WARNING_METADATA = "kpng-warning"
"""Initial metadata of a node-local watch: what the server wants its watcher's user to know (a
node it does not know), as Kubernetes' API sends ``Warning`` headers. Clients that do not read it
(Go KPNG's) lose nothing."""
