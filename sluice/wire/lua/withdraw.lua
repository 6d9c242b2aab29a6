-- withdraw.lua: undo queue.lua for the jobs still queued (durable accept, when the fsync was not
-- confirmed: `sluice.wire.broker.Broker`).
--
-- KEYS[1..]: the jobs' hashes, of one version (one slot)
--
-- ARGV: none
--
-- Returns: the ids withdrawn, whose quota places the caller frees.
--
-- Their records go; the entries stay, and a worker settles them as `missing`.
local withdrawn = {}
for k = 1, #KEYS do
  if redis.call('HGET', KEYS[k], 'status') == 'queued' then
    withdrawn[#withdrawn + 1] = redis.call('HGET', KEYS[k], 'id')
    redis.call('DEL', KEYS[k])
  end
end
return withdrawn
