"""The vocabulary the session and the worker processes share: domain values and errors
(`domain`), canonical JSON and digests (`canonical`), the design/session.md §1.8 data types
(`datatypes`), exact time (`ticks`), the request and outcome codec (`rpc`), the session contract's
identities and method schemas (`contract`) and the typed structures generated from those schemas
(`structures`).

Why a package of its own: flyd's session and the worker shell both speak these types, so they
live beside neither; the shell (`workers.shell`) and the bodies that run it are the worker's
side only, and flyd imports none of them.
"""
