-- refresh.lua: keep the entries a worker holds (in its batcher, on its model, being stored) from
-- looking idle to XAUTOCLAIM (`sluice.wire.streams.StreamConsumer.refresh`).
--
-- KEYS[1]: a lane's stream
--
-- ARGV[1]: the consumer group
-- ARGV[2]: the consumer
-- ARGV[3..]: the entry ids it holds
--
-- Returns: the ids it no longer owns.
--
-- Each id still pending under the consumer's own name is claimed again, JUSTID, which resets its
-- idle time without counting a delivery. An id pending under another consumer (taken over while
-- this one stalled) or no longer pending (acknowledged) is never claimed back. XCLAIM goes in
-- chunks of 1000 ids, to keep unpack within Lua's stack.
local mine, lost = {}, {}
for i = 3, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) == 1 then
    mine[#mine + 1] = ARGV[i]
  else
    lost[#lost + 1] = ARGV[i]
  end
end
for first = 1, #mine, 1000 do
  local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
  for i = first, math.min(first + 999, #mine) do args[#args + 1] = mine[i] end
  args[#args + 1] = 'JUSTID'
  redis.call(unpack(args))
end
return lost
