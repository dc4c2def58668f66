"""
title: Broken
version: 0.1
"""


class Filter:
    def inlet(self, body: dict) -> dict
        return body
