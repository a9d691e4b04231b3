"""Example plugin packages for flyd: small, complete compositions to copy from (docs/plugins.md).

Not part of the installed distribution: a node imports them from the repository root, which a
`flyd run` started there has on its import path, or from a directory named by `--plugin-path` /
`[plugins] paths`.
"""
