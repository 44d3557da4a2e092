"""What every kvps server process shares at its edges.

- ``auth``: bearer tokens from a token file, re-read when it changes
- ``tls``: TLS contexts for client and admin traffic
- ``lifecycle``: log lines and stopping on a signal
"""
