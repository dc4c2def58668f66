"""
title: Needs the Open WebUI database
version: 0.1
"""

from open_webui.models.users import Users


class Filter:
    def inlet(self, body: dict, __user__: dict) -> dict:
        Users.get_user_by_id(__user__["id"])
        return body
