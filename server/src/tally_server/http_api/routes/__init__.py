"""The HTTP routes, one module per resource, each with ``add_routes(app, service, guard)``.

Every ``/v1`` route declares the operation it serves (``Depends(guard.requires(...))``, see
``http_api/auth.py``), which decides its role and where its checkpoint is checked.
"""
