"""The upstream pool: kept-alive HTTP/1.1 connections to one worker URL, shared by its ranks."""
