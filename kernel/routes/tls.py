"""GET /localm-ca.crt: localm's CA certificate, for clients to trust its HTTPS server."""

from __future__ import annotations

import asyncio

from litestar import Request, Response

from ..errors import LocalmError
from ..routing import get
from .common import kernel_of


@get("/localm-ca.crt", access="public",
     summary="The local CA certificate (PEM) that signs this server's HTTPS certificate",
     errors={404: "localm has made no CA (HTTPS was never set up), or the server serves its owner's own "
                  "certificate", 409: "the CA certificate file cannot be read"})
async def ca_certificate(request: Request) -> Response:
    from ..tls import ca_pem

    k = kernel_of(request)
    if k.tls is not None and k.tls.own:
        raise LocalmError(404, "This server serves its owner's own certificate (tls_cert), not one signed by "
                               "localm's CA: trust the CA that issued it", code="no_localm_ca")
    pem = await asyncio.to_thread(ca_pem, k.data_dir)
    if pem is None:
        raise LocalmError(404, "localm has no CA: HTTPS was never set up (localm config set tls_enabled true, then "
                               "restart the server)", code="no_localm_ca")
    return Response(pem, media_type="application/x-x509-ca-cert",
                    headers={"Content-Disposition": 'attachment; filename="localm-ca.crt"',
                             "Cache-Control": "no-cache"})


ROUTES = [ca_certificate]
