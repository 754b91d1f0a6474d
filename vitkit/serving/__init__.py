"""``vitkit serve``: a model file behind an HTTP endpoint on LitServe. ``api.py`` is the LitServe API over a task's
predictor (``vitkit.tasks.protocol``), ``model.py`` reads the model file, ``gate.py`` stands in front of LitServe's app
(the API key, the body limit, the request forms, the page, ``/metrics``), ``openapi.py`` describes the API and
``page.html`` is the page at ``/``."""
