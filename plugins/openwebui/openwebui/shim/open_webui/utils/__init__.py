"""``open_webui.utils``: of it, localm provides ``misc``."""
