"""SGLang backends for rollouts (DESIGN.md section 5).

* ``contract``: every request and response field either mode uses, checked on receipt.
* ``launcher``: start a stock SGLang server (or connect to given URLs), health, restart once.
* ``verify_client``: verify mode, our process drafts and SGLang verifies over HTTP.
* ``native``: native mode, SGLang runs DFLASH itself; the plugin and the record conversion.

The stand-in server for tests is ``specforge_opd.testing.standin``.

Nothing here imports SGLang at module level: it usually lives in another environment.
"""
