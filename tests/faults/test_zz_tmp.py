import asyncio
import httpx

def test_burst(api, seeded, register_synthetic, figure):
    model = register_synthetic("burst")
    async def go():
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        async with httpx.AsyncClient(base_url=api.url, headers={"Authorization": f"Bearer {seeded.demo_key}"}, limits=limits, timeout=60) as c:
            rs = await asyncio.gather(*(c.post(f"/v1/models/{model}/jobs", json={"input": {"text": f"x {i}"}}) for i in range(600)), return_exceptions=True)
        return rs
    rs = asyncio.run(go())
    codes = {}
    bodies = set()
    for r in rs:
        k = r.status_code if isinstance(r, httpx.Response) else type(r).__name__
        codes[k] = codes.get(k, 0) + 1
        if isinstance(r, httpx.Response) and r.status_code >= 500:
            bodies.add(r.text)
    figure("codes", codes)
    figure("bodies", bodies)
